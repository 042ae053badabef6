//go:build tools

// Package tools pins the code generators the build runs (gopy and goimports), so that
// go.mod records their versions and `go install` of them needs no network version list.
package tools

import (
	_ "github.com/go-python/gopy"
	_ "github.com/go-python/gopy/gopyh"
	_ "golang.org/x/tools/cmd/goimports"
)
