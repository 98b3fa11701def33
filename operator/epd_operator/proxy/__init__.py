"""The EPD proxy (`epd-operator proxy`): in front of a unit's router, it primes every media part
of an ordinary OpenAI client's request on the encoders before forwarding it unchanged, so no
client has to know about encoders. core.py decides (pure), encoders.py keeps the list of
encoders, http1.py speaks HTTP/1.1 (httptools), server.py is the shell. docs/proxy.md explains
the design and its limits."""
