"""``clew serve``: an OpenAI-compatible server for a policy and the LoRA adapters trained on it.

``server`` puts the parts together (``Server``, ``run_server``), ``app`` is the HTTP layer
(FastAPI), ``scheduler`` batches requests onto the engine, ``adapters`` lists and fetches the
adapters, ``adapter_pool`` holds them in the engine, ``prompt`` encodes chat messages as the
rollouts do, ``protocol`` is OpenAI's wire format, ``metrics`` the Prometheus metrics,
``ray_serve`` the Ray Serve application (``clew.serve:build_app``, imported on first use: it
needs Ray). Needs the ``serve`` extra (``pip install 'clew[serve]'``).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from clew.serve.ray_serve import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
