"""Lane kinds as plug-ins: the protocol and registry (:mod:`loader.kinds.base`) and the built-in kinds.

Importing any module of this package registers the built-in kinds, in this order (the order
manifest entries are parsed in):

* :mod:`~loader.kinds.text`  ``text`` (tokenized online) and ``tokens`` (pre-tokenized ids)
* :mod:`~loader.kinds.chat`  ``chat`` (conversations rendered online) and the manifest's ``chat`` entry
* :mod:`~loader.kinds.image` ``image`` and ``image-chat``, and the manifest's ``images`` entry

The core imports only :mod:`loader.kinds.base`; a kind module imports the core and its own
package (:mod:`loader.chat`, :mod:`loader.vision`), never another kind's.
"""

from loader.kinds import chat, image, text  # noqa: F401  (the built-in kinds register themselves)
