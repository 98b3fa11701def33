"""The EPD proxy (`epd-dataplane proxy`): in front of a unit's router, it primes every media part
of an ordinary OpenAI client's request on the encoders before forwarding it unchanged, so no
client has to know about encoders. core.py decides (pure), limits.py bounds (pure), budget.py
holds the memory budget, encoders.py keeps the list of encoders, server.py is the shell on
aiohttp's HTTP server and client. docs/proxy.md explains the design and its limits."""
