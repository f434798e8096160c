"""What a client trains and a server evaluates, without Flower: datasets, models, plug-ins, the product's training."""
