"""A synchronous scheduler's lookup client (vLLM's ``LookupKeyClient`` contract), no vLLM
import here (``aio_mclookup.vllm`` plugs it in). The data flow: ``client`` (the contract, a
step's lookups sent together) -> ``channels`` (a sidecar process, or a thread in-process) ->
``messages`` (what is said, framed) -> ``service`` (one coordinator answering them), run in
``sidecar`` (the child process) or on a ``loop`` thread; ``config`` says where the Mooncake
clients connect; ``pacing`` paces the hits handed to the scheduler (the plug-in uses it)."""
