"""A synchronous scheduler's lookup client (vLLM's ``LookupKeyClient`` contract): an event loop
on a thread of its own (``loop``), the coalescing client on it (``client``), and where its
Mooncake client connects (``config``). No vLLM import here; ``aio_mclookup.vllm`` plugs it in."""
