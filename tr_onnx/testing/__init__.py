"""Test doubles of the cuda backend's device, usable without a GPU: ``recorder.FakeRecorder``
(records and checks every call) and ``host_emulator.HostEmulator`` (also runs them: kernels
through their g++ host build, cuDNN graphs through their nodes' NumPy kernels). The tests, the
GPU check's dry run and ``tr-onnx inspect --backend cuda`` use them; the backend never imports
this package.
"""
