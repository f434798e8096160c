"""The client side of an update: the send pipeline (compensate, compress, update memory, encode), its running
totals, the ack ledger."""
