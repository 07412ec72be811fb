"""Rule export: one variant as ONNX (fp32, fp16, FP8 Q/DQ), the graph onnxruntime and tensorrt build from."""
from quantstudy.jobserver import optional, run

run("quantstudy.steps_engines:export", snakemake.log[0], checkpoint_json=str(snakemake.input.checkpoint),
    amax_json=optional(snakemake.input, "amax"), out=str(snakemake.output.export), **snakemake.params)
