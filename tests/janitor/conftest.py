"""The real-vLLM fixtures of tests/vllm, for the janitor's tests against a real encoder."""

from tests.vllm.conftest import serving_python, tiny_model_dir, vllm_timings

__all__ = ["serving_python", "tiny_model_dir", "vllm_timings"]
