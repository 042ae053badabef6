"""The graphed callables and what their replays guard or share.

``graphed`` is :class:`GraphedCallable` and its autograd Function; ``_shared_inputs`` and
``_regions`` check inputs that share memory, ``_sharers`` the callables that share one set of
graphs, ``_handouts`` the static buffers lent to the caller, ``_grad_pack`` the owned copies of
parameter grads.

Imports only downward: request, runtime, core, support.
"""
