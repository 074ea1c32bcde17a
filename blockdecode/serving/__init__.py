"""Heads and drafters in the formats serving engines load (vLLM, SGLang, llama.cpp)."""
