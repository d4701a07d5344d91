"""Serving elsewhere: `dcoco-hf export` (public DFlash and vLLM folders), the vLLM plugin and draft model, and the
block corrector any engine runs.
"""
