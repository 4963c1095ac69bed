"""The reference models in pure torch (the target, the DFlash drafter and its Markov head, their layers, the attention
seam, the KV cache), the generic transformers target, and loading them from files."""
