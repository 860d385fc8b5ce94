"""kvwire with vLLM: the engines' processes, the proxy, the demo.

kvctl never imports vLLM or torch: engines run in their own environment
(``make vllm-env``), as separate processes, the way a user runs them.
"""
