"""``clew serve``: an OpenAI-compatible server for a policy and the LoRA adapters trained on it.

``server`` puts the parts together (``Server``, ``run_server``), ``app`` is the HTTP layer
(FastAPI) and ``middleware`` what every request passes first (request ids, API key, body
size), ``openapi`` the schema's documented errors, ``scheduler`` batches requests onto the
engine (``running`` and ``batches``: the running batches, and how a failed step is narrowed
to its rows), ``adapters`` lists and fetches the adapters (``adapter_files``: their names,
stamps and checks), ``adapter_pool`` holds them in the engine, ``prompt`` encodes chat
messages as the rollouts do, ``protocol`` is OpenAI's wire format, ``errors`` the refusals,
``metrics`` the Prometheus metrics, ``playground`` the page that plays envs (``episodes``,
``playground_models``), ``ray_serve`` the Ray Serve application (``clew.serve:build_app``,
imported on first use: it needs Ray). Needs the ``serve`` extra (``pip install
'clew[serve]'``). docs/serving.md lists the limits and what each refusal means.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from clew.serve.ray_serve import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
