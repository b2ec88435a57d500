"""Where keras_dist meets the private names of JAX, TensorFlow and torch.

Like `keras_glue` for Keras: each private name of a framework that
keras_dist reaches (``jax._src``, ``tensorflow.python``, torch's
underscored names) is behind one function in that framework's module here
(`jax_private`, `tensorflow_private`, `torch_private`), named for what it
does, its docstring naming the private name and why no public API serves.
When a framework release moves one, these modules are the ones to change;
`tests/test_contract.py` checks that no other module names them and calls
every function here for the running backend.

Importing these modules imports no framework: each function imports what
it needs when called.
"""
