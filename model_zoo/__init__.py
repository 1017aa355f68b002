"""Small, deterministic ONNX model zoo used by the tr_onnx tests (see ``export_models``)."""
