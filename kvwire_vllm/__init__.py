"""kvwire as vLLM's KV connector: ``kvwire_vllm.connector.KvwireConnector``.

Installed into the engine's environment (``pip install 'kvwire[vllm]'``),
never imported by the daemons: kvwired stays free of torch and vLLM. Only
``connector``, ``cache``, ``producer``, ``consumer`` and ``offline`` import
them; ``params``, ``scheduling``, ``seal``, ``stats`` and ``model`` are plain
Python, tested with the daemons' suite.
"""
