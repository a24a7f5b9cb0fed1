"""``clew serve``: an OpenAI-compatible server for a policy and the LoRA adapters trained on it.

``server`` puts the parts together (``Server``, ``run_server``), ``app`` is the HTTP layer
(FastAPI), ``scheduler`` batches requests onto the engine, ``adapters`` lists, fetches and
holds the adapters, ``prompt`` encodes chat messages as the rollouts do, ``protocol`` is
OpenAI's wire format, ``metrics`` the Prometheus metrics. Needs the ``serve`` extra
(``pip install 'clew[serve]'``).
"""
