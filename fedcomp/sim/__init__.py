"""The one-machine simulation's parts: virtual clock and transport, links, the wire-bytes model of Flower's
transport."""
