"""Test-only support: vLLM's CPU platform, Model Runner V2 under the Triton interpreter, and a
custom logits processor (which makes vLLM pick its V1 runner), and held mask rows sent every few
steps by CPU engine cores."""
