"""Execution of the optimizer maths: single process, or sharded over DTensor/FSDP2 with counted collectives."""
