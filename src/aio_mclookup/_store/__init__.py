"""Store: the interfaces (``protocol``), an in-process fake (``fake``), Mooncake's error codes
(``codes``), the crash-proof client pool (``pool``) and :class:`MooncakeStore` (``mooncake``)."""
