// Package wire names the versions of the line protocols that cross the
// boundary between Python and the core: what Python sends (the facts
// warmup learned, the allocation trace of a warmup) and what the core
// returns (the steps of a schedule, the warmup and capture programs, the
// memory prediction). Every text starts with a header line "NAME vN", and
// a reader refuses a text of another name or version with an error that
// says which it got and which it reads: a Python package and a core built
// from different sources then fail at the first plan, saying so, instead of
// misreading each other's lines.
package wire

import (
	"fmt"
	"strings"
)

// Protocol is one line protocol and the version this core speaks.
type Protocol struct {
	Name    string
	Version int
}

// The protocols (docs/CORE_API.md has their lines).
var (
	Steps      = Protocol{"schedule", 1}   // core -> Python: a schedule's steps
	Warmup     = Protocol{"warmup", 1}     // core -> Python: the warmup program
	Program    = Protocol{"program", 1}    // core -> Python: the capture program
	Facts      = Protocol{"facts", 1}      // Python -> core: what warmup learned
	Trace      = Protocol{"trace", 1}      // Python -> core: what a warmup allocated
	Prediction = Protocol{"prediction", 1} // core -> Python: the memory prediction
	Pools      = Protocol{"pools", 1}      // Python -> core: a training run's allocations, by pool
	Footprint  = Protocol{"footprint", 1}  // core -> Python: what those pools reserve
	GradSlots  = Protocol{"gradslot", 1}   // core -> Python: the grad-slot policy
)

// Header is the first line of a text of p, with fields after the version
// ("key=value" words), newline-terminated.
func (p Protocol) Header(fields ...string) string {
	h := fmt.Sprintf("%s v%d", p.Name, p.Version)
	if len(fields) > 0 {
		h += " " + strings.Join(fields, " ")
	}
	return h + "\n"
}

// Body checks that text starts with p's header line (blank lines before it
// are skipped) and returns the header's fields after the version and the
// rest of the text.
func (p Protocol) Body(text string) (fields []string, body string, err error) {
	rest := text
	for {
		line, tail, found := strings.Cut(rest, "\n")
		if strings.TrimSpace(line) != "" || !found {
			f := strings.Fields(line)
			want := fmt.Sprintf("v%d", p.Version)
			if len(f) < 2 || f[0] != p.Name || f[1] != want {
				return nil, "", fmt.Errorf("%s: the text starts with %q, not the header %q (this core reads version %d)", p.Name, clip(line), p.Name+" "+want, p.Version)
			}
			return f[2:], tail, nil
		}
		rest = tail
	}
}

func clip(s string) string {
	if len(s) > 40 {
		return s[:40] + "..."
	}
	return s
}
