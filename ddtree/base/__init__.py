"""The lowest layer: validated settings and environment knobs, safe file writes, the cache layer, where the kernels
are, the machine (its CPU and load), hub ids. Imports nothing else from ddtree."""
