// Command coredns is CoreDNS with only the plugins the local node needs: cluster DNS for Services
// and pods (kubernetes), nothing that forwards beyond the machine. CoreDNS documents building a
// trimmed server this way (set dnsserver.Directives, import the plugins, call coremain.Run).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/template"
)

// Order matters: it is the order in which a query passes the plugins.
var directives = []string{"bind", "ready", "health", "errors", "log", "cache", "kubernetes", "template"}

func init() { dnsserver.Directives = directives }

func main() { coremain.Run() }
