"""A throwaway PKI for one local cluster: CA, serving and client certs, SA keys."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = dt.timedelta(days=365)


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    # Kubernetes maps CN to the user name and O to its groups.
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class PKI:
    """Creates every credential of a cluster under one folder (``<dir>/pki``)."""

    def __init__(self, folder: Path) -> None:
        self.dir = folder
        self.dir.mkdir(parents=True, exist_ok=True)
        now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # clock skew slack
        self._not_before, self._not_after = now, now + _VALID
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        self._ca_name = _name("epd-local-ca")
        ca = (
            self._builder(self._ca_name, self._ca_key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._ca_key, hashes.SHA256())
        )
        _write_cert(ca, self.ca_cert)
        _write_key(self._ca_key, self.ca_key)

    @property
    def ca_cert(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    def _builder(self, subject: x509.Name, public_key) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._ca_name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before)
            .not_valid_after(self._not_after)
        )

    def issue(
        self,
        name: str,
        cn: str,
        *,
        orgs: tuple[str, ...] = (),
        dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
    ) -> tuple[Path, Path]:
        """Issue ``<name>.crt``/``<name>.key``: a server cert when given SANs, else a client cert."""
        key = ec.generate_private_key(ec.SECP256R1())
        server = bool(dns or ips)
        usage = [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            self._builder(_name(cn, orgs), key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        )
        if server:
            sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert_path, key_path = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        _write_cert(builder.sign(self._ca_key, hashes.SHA256()), cert_path)
        _write_key(key, key_path)
        return cert_path, key_path

    def service_account_keys(self) -> tuple[Path, Path]:
        """RSA pair the apiserver signs service-account tokens with (RS256, the usual choice)."""
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        private, public = self.dir / "sa.key", self.dir / "sa.pub"
        _write_key(key, private)
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        return private, public
