"""`python -m cadence.chat_templates NAME` prints the path of a shipped chat template (for
--chat-template); without NAME, lists them."""

import sys

from cadence.chat_templates import names, template_path

if len(sys.argv) < 2:
    print("\n".join(names()))
else:
    try:
        print(template_path(sys.argv[1]))
    except ValueError as e:
        sys.exit(str(e))
