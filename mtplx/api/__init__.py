"""The OpenAI and Anthropic protocol: request models, validation, errors, response shapes and the
lane compatibility key. Plain Python (pydantic), no MLX: the ingress imports only this."""
