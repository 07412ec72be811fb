"""Rule export: one variant as ONNX (fp32, fp16, FP8 Q/DQ), the graph onnxruntime and tensorrt build from."""
from quantstudy import steps

with steps.logged(snakemake.log[0]):
    steps.export(checkpoint_json=snakemake.input.checkpoint, amax_json=snakemake.input.get("amax"),
                 out=snakemake.output.export, **snakemake.params)
