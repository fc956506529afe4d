"""Test-only support: vLLM's CPU platform and Model Runner V2 under the Triton interpreter."""
