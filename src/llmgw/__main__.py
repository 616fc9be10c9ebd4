"""python -m llmgw."""

from llmgw.cli.command import main

raise SystemExit(main())
