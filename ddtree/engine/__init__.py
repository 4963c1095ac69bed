"""The engine: the one decoding loop (decoder.py) and its pure parts: the method registry, trees, sampling, the
adaptive budget, stops, statistics, traces and the lossless checker."""
