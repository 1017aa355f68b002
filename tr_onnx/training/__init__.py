"""Training: from a dispatched inference graph to trained weights written back into the model.

``pipeline``: the order of the training graph transform (``build_training_step``);
``train_pass``: its steps (train-mode ops, labels, loss, backward pass, optimizer, step guard);
``losses``: the builtin losses; ``precision``: half storage and loss scaling;
``gradients``: vector-Jacobian products of a model, for checks; ``session``:
``TrainingSession``, the facade over ``options`` (its checked choices), ``state`` (what
training changes, in which plan's arena) and ``steps`` (launching steps, reading them back);
``checkpoints``: saving and resuming a session; ``export``: trained weights back into the
original ModelProto; ``trainer``: epochs, validation, resume, with ``records`` (totals, the
metrics file, printed lines)."""
