"""The op domains tr_onnx tells apart: ONNX's own (spelled two ways) and its internal one, for
the ops its passes add (training-mode forms, gradients, optimizer steps, layout changes) that
no user's model may contain."""

ONNX_DOMAINS = ("", "ai.onnx")  # the default domain: a node or opset_import may write either
INTERNAL_DOMAIN = "ai.tr_onnx"


def is_onnx_domain(domain: str) -> bool:
    return domain in ONNX_DOMAINS
