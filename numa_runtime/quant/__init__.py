"""Quantized weights: formats (formats.py), the packed layout (packing.py), the numpy
reference QLinear (reference.py), and building a model's linears from any weight source
(loader.py)."""
