"""The front door's arguments: one ``make_graphed_callables`` call as a Request.

``_args`` normalises the arguments of torch's and TransformerEngine's
``make_graphed_callables`` into a :class:`~gograph.request._args.Request` and its pass specs;
``_te`` holds TransformerEngine's protocols (delayed weight gradients, capture-time hooks, its
sample forms); ``_entries`` TransformerEngine's reorganisation of a sample list; ``_fit`` the
checks that depend on the engine; ``_marks`` the mark a graphed callable leaves on its module.

Imports only downward: runtime, core, support.
"""
