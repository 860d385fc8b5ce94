"""Tests that need root and two network namespaces: daemons as processes on
two hosts joined by a veth (and vLLM engines, in test_vllm_e2e)."""
