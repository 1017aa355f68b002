"""Training: from a dispatched inference graph to trained weights written back into the model.

``pipeline``: the order of the training graph transform (``build_training_step``);
``train_pass``: its steps (train-mode ops, labels, loss, backward pass, optimizer, step guard);
``losses``: the builtin losses; ``precision``: half storage and loss scaling;
``gradients``: vector-Jacobian products of a model, for checks; ``session``:
``TrainingSession`` (steps, evaluation, checkpoints); ``export``: trained weights back into
the original ModelProto; ``trainer``: epochs, metrics, resume."""
