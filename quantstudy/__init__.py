"""quantstudy: reproducible FP8 quantization studies.

The package holds every step of the study; the Snakemake workflow only wires the steps
together. It never imports snakemake.
"""
