"""The OpenAI- and Anthropic-compatible HTTP ingress (no MLX in this process).

Per request: route (`routes`: Starlette's router, the API key, request ids, errors in the route's
shape), parse and validate (pydantic, 400s naming the field), apply the chat template and
tokenize, then hold a place in the bound on waiting rows (`admission`) and build one typed row
(`mtplx.api.rows.RowSpec`). Rows enter the `@serve.batch` window; each window goes to one MTP
replica as a single streaming call, whose per-row updates are demultiplexed back to the rows
(`dispatch`). Each row then turns tokens into text, cuts it at the stop string the replica ended
it on, and carries the engine's `End` (`row_stream`), and answers as JSON or SSE in its route's format (`formats`: chat, completion,
Anthropic message; `responses`: a Responses response, kept in `response_store`).

Row-level cancellation: a client that disconnects cancels only its row, with a call pinned (by `deployments.router`) to the replica that runs
its cohort; a row whose client left before its window closed is never sent. The cohort stream
itself is never cancelled by one row.
"""

from .server import OpenAIIngress

__all__ = ["OpenAIIngress"]
