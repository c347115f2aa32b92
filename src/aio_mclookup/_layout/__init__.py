"""Layout: group specs (``groups``), rank namespaces and key prefixes (``namespaces``), what
the planner derives once per layout (``geometry``), and :class:`KVLayout` itself (``layout``:
validation and the dict form)."""
