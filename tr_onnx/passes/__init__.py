"""Graph passes, run in order: dispatch -> layout (-> autodiff, optimizer: training)."""
