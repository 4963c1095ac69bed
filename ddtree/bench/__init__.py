"""Measuring: the benchmark (the main job), its prompt sets, the shared runner and compare, the peer programs (HF
generate, llama.cpp), seeded random pairs for tests and timing."""
