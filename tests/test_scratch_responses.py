import json, pytest
from conftest import TEST_API_KEY
MODEL = "mtplx-tiny-py"

@pytest.mark.ray
def test_scratch(client, http):
    r = client.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=16, temperature=0)
    print(r.model_dump_json(indent=1)[:3000])
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=16, temperature=0)
    print(repr(c.choices[0].message.content), repr(r.output_text), c.usage)
    with client.responses.stream(model=MODEL, input="def add(a, b):", max_output_tokens=16, temperature=0) as s:
        for e in s:
            print(e.type, getattr(e, "delta", None))
    g = client.responses.retrieve(r.id)
    print(g.id, g.status)
