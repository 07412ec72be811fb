"""Rule gemm: the FP8 variants' GEMMs alone, fp16 against FP8 at the model's shapes (g of the bound)."""
from quantstudy.jobserver import run

run("quantstudy.steps_measure:gemm", snakemake.log[0], checkpoint_json=str(snakemake.input.checkpoint),
    amax_json=str(snakemake.input.amax), out=str(snakemake.output.gemm), **snakemake.params)
