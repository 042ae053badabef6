//go:build tools

// Package tools pins the tools the build and the checks run (gopy and goimports for the
// extension, staticcheck for `make test`), so that go.mod records their versions and
// `go install` of them needs no network version list.
package tools

import (
	_ "github.com/go-python/gopy"
	_ "github.com/go-python/gopy/gopyh"
	_ "golang.org/x/tools/cmd/goimports"
	_ "honnef.co/go/tools/cmd/staticcheck"
)
