"""Seed candidates: one correct Triton kernel per lab task, written as a *template*.

Each module is an ordinary Python module (the package imports it, the compile check
compiles it) and at the same time the text the search mutates. Its genes are the
module-level lines ending in ``# gene``; ``GENE_SPACE`` lists the values each gene may
take. Rendering a candidate rewrites those lines (:func:`gpulab.lab.candidate.render`),
so every candidate is a complete, readable file with the same entry point,
``launch(inputs..., outputs...)``, in the task spec's argument order.
"""
