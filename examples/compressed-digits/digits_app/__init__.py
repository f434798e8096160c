"""A minimal Flower app with fedcomp's compression: see README.md."""
