"""Training: the train pass (train-mode ops, loss, autodiff, optimizer nodes), the compiled
step, TrainingSession, export and checkpoints."""
