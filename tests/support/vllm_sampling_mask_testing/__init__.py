"""Test-only support: vLLM's CPU platform, Model Runner V2 under the Triton interpreter, and a
custom logits processor (which makes vLLM pick its V1 runner), held mask rows sent every few
steps by CPU engine cores, and a check of vLLM objects' attribute layout (``object_layout``)."""
