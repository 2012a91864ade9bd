"""The engine: prefill, the running lane (proposer, acceptor, commit) and its installation and
self-check. No scheduler, no protocol: rows in, tokens out."""
