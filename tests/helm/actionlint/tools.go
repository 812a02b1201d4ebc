//go:build tools

// Package tools pins the actionlint command that `make helm` builds to check
// .github/workflows (go build github.com/rhysd/actionlint/cmd/actionlint); nothing here
// is compiled.
package tools

import (
	_ "github.com/rhysd/actionlint/cmd/actionlint"
)
